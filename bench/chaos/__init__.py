"""`pdserve bench chaos`: mixed load while replicas are killed and frozen (`main`): the requests
with their references (`load`) and what the run records (`report`)."""
