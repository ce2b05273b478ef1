from services.sampler.main import main

if __name__ == "__main__":
    main()
