"""`pdserve bench overload`: tenants' classes at a multiple of the fleet's goodput, admission
on vs off (`main`): what is sent and to which app (`plan`), the client (`load`), the report
(`report`); `python -m bench.overload.cost` measures the front door's CPU time per request."""
