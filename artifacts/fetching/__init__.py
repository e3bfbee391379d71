"""Bytes in from peers (the Hub, a ModelScope mirror): the download engine, fetch, and re-fetching."""
