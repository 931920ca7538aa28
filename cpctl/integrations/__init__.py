"""The integrations with other libraries (transformers, accelerate): below the runtime, seen by it
through narrow interfaces."""
