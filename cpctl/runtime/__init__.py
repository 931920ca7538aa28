"""The worker side: what runs inside each training process.

`runtime` (the `cpctl.init()` object), `mesh` (the DeviceMesh and its axes), `context` (the step
in progress), `preparation` (prepare_model's pipeline), `adapters` (what integrations register),
`parallelize` (TP, checkpointing, FSDP2), `selective` (selective checkpointing), `data` and
`documents` (tokens and packed documents), `losses` and `step_losses`, `guards` (misuse caught
at run time), `checkpoint` and `process` (the process group's life and error reports).
"""
