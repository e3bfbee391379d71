"""mm's commands, one module per area (fetch, verify, bundle, oci, image, launch), each imported only when one of
its commands runs (cli.py holds the registry); shared.py is what they all use."""
