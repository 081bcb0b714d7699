"""What every benchmark shares: servers, the table of targets, clients and stats."""
