"""``python -m hpcrl.reward --run-dir DIR``: the reward service component (hpcrl/reward/service.py)."""

from hpcrl.reward.service import main

if __name__ == "__main__":
    main()
