from services.weight_broker.service import main

main()
