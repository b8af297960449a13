"""Finding peers: mDNS on the LAN (mdns.py) into one verified peer table (table.py)."""
