from services.reward.main import main

if __name__ == "__main__":
    main()
