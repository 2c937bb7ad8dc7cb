"""Drop-in entry points for users of other libraries (`offload.compat.deepspeed`)."""
