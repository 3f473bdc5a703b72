from hpcrl.trainer.main import main

main()
