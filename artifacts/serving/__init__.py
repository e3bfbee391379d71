"""The engine image, docker, the offline start, the node, warm-up, pre-flight checks and diagnosis."""
