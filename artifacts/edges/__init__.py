"""Everything that touches the outside: files, hostile JSON, tools, the network, signals, the terminal."""
