from services.weight_broker.main import main

main()
