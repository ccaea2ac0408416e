"""Train a LandmarkGPT (or its full-attention baseline); see ``--help``.

The loop lives in ``landmark_memory.training.train`` so that the ``landmark-memory train`` command and
this script are one program.
"""

from landmark_memory.training.train import main

if __name__ == "__main__":
    main()
