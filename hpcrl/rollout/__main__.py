from hpcrl.rollout.main import main

main()
