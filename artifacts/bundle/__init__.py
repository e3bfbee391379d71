"""Bundles: a verified model (plus payloads) as self-describing tar volumes, checked and imported anywhere.

Modules, each importing only those above it in this list (one way, never back):
  fields      typed fields of a hostile JSON record (the index)
  copyio      the hashing read-ahead pipe (ChunkPipe), writeback that follows a copy (WriteBehind), read-back
  wheelhouse  mm itself for the air-gapped host: locked wheel sets per platform and the sh installer (install-mm.sh)
  parity      the Reed-Solomon code over byte streams (pyeclib): stripes, encode, rebuild; knows no tar
  proof       a data volume's proof for the parity index: from its members' blake3 and the bytes between them
  payloads    what rides beside the model: PAYLOAD_KINDS, one entry per kind (image, kernel caches, mm's wheels)
  format      volume names (data and parity), tar headers, member names and sizes
  index       the per-volume index as typed records (Index, Entry; ParityIndex, Stream), checked while parsed
  volume      reading a volume safely, data or parity (open_volume, find_volumes)
  delta       a delta's base: read it, plan what is taken from it, check it at the destination, take its files
  check       `mm bundle verify` (verify_volumes), which parity volumes a rebuild may use, what is recoverable
  pack        `mm bundle` (create_bundle), parity volumes included (write_parity_volumes)
  unpack      `mm unbundle` (unbundle), rebuilding lost data volumes from parity (rebuild_data_volumes)
  repair      `mm bundle repair-volume` (repair_volumes)
"""
