"""``python -m dflash2_tools.train``: train a DFlash 2 drafter (the stages live in ``dflash2_tools.training``)."""

from .training.loop import main

if __name__ == "__main__":
    main()
