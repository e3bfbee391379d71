"""What a model directory is and proving it: the manifest, hashing, safetensors, verify, signatures."""
