"""Slurm deployment: sbatch rendering, submitit submission, placement."""
