"""The worker side: what runs inside each training process.

`runtime` (the `cpctl.init()` object), `mesh` (the DeviceMesh), `parallelize` (TP, checkpointing,
FSDP2), `selective` (selective checkpointing), `data` and `documents` (tokens and packed
documents), `losses`, `guards` (misuse caught at run time), `checkpoint` and `process` (the
process group's life and error reports).
"""
