"""Bundles: a verified model (plus payloads) as self-describing tar volumes, checked and imported anywhere.

Modules, each importing only those above it in this list (one way, never back):
  fields    typed fields of a hostile JSON record (the index)
  parity    the Reed-Solomon code over byte streams (pyeclib): stripes, encode, rebuild; knows no tar
  payloads  what rides beside the model: PAYLOAD_KINDS, one entry per kind (image, kernel caches)
  format    volume names (data and parity), tar headers, member names and sizes, --volume-size parsing
  index     the per-volume index as typed records (Index, Entry; ParityIndex, Stream), checked while parsed
  copyio    the hashing read-ahead pipe (ChunkPipe), writeback that follows a copy (WriteBehind), read-back
  volume    reading a volume safely, data or parity (open_volume, find_volumes)
  check     `mm bundle verify` (verify_volumes), which parity volumes a rebuild may use, what is recoverable
  pack      `mm bundle` (create_bundle), parity volumes included (write_parity_volumes)
  unpack    `mm unbundle` (unbundle), rebuilding lost data volumes from parity (rebuild_data_volumes)
  repair    `mm bundle repair-volume` (repair_volumes)
"""
