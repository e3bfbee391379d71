"""OCI registries: push and pull models as CNCF ModelPack artifacts (client, format, push, pull)."""
