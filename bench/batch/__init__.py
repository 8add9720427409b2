"""`pdserve bench batch` (`main`): a batch job on an idle service against the engine offline,
and beside interactive load; the job client, offline run and capacity probe (`jobs`), the
verdicts and figure (`report`)."""
