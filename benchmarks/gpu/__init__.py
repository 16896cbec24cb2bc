"""The GPU end-to-end check (gpu_check.py, standard library only, runs steps.py under the interpreter it installs)."""
