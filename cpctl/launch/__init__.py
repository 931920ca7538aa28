"""The launcher side: what runs in the `cpctl` process before any worker exists.

The command line (cli, views), the wizard, the environment checks (envinfo), the launch plan and
torchrun (launcher), and what an accelerate script's workers are told (accelerate_env).
Torch-free: none of these modules imports torch at import time.
"""
