"""Bundles: a verified model (plus payloads) as self-describing tar volumes, checked and imported anywhere.

Modules, each importing only those above it in this list (one way, never back):
  fields    typed fields of a hostile JSON record (the index)
  payloads  what rides beside the model: PAYLOAD_KINDS, one entry per kind (image, kernel caches)
  format    volume names, tar headers, member names and sizes, --volume-size parsing
  index     the per-volume index as typed records (Index, Entry), checked while parsed
  copyio    the hashing read-ahead pipe (ChunkPipe) and early writeback (EarlyFlush)
  volume    reading a volume safely (open_volume, find_volumes)
  check     `mm bundle verify` (verify_volumes)
  pack      `mm bundle` (create_bundle)
  unpack    `mm unbundle` (unbundle)
"""
