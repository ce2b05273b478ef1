from services.learner.main import main

if __name__ == "__main__":  # spawned ranks import this module again
    main()
