"""mm's library: one module per capability (hub, manifest, verify, mirror, bundle, launch)."""
