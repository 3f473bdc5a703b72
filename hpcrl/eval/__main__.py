from hpcrl.eval.main import main

main()
