"""Offline batch jobs: the OpenAI Files and Batch API on spare capacity, durable, per tenant.

store.py    files (uploads and outputs) in the durable store, atomic writes
jobs.py     batch objects, result logs and leases in the store (the job's life)
lines.py    input lines parsed and checked; results as output and error lines
execute.py  one line through the front door, in the batch SLO class
pacing.py   how many lines run at once, against more important traffic
runner.py   one job run to its end by the replica holding its lease
service.py  the API of one ingress replica, and its job poller and pacer
fleet.py    what the service reads of the fleet: load to pace by, unit cost
upload.py   a multipart upload read within the size limit
routes.py   the HTTP routes (FastAPI), included by the ingress
cli.py      `pdserve batch submit`
"""
