"""hpcrl: asynchronous RL and SFT for language models on SLURM clusters."""

__version__ = "0.1.0"
