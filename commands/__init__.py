"""mm's commands, one module per area, each imported only when one of its commands runs (cli.py holds the registry
that says which module defines which command): fetch (fetch, manifest, mirror), verify (verify, sign, repair), bundle
(bundle, unbundle), oci (push, pull, inspect), image (image save), launch (launch, warmup, doctor, diagnose), store
(ls, use, gc). shared.py is what they all use."""
