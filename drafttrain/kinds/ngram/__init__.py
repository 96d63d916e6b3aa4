"""n-gram prompt lookup: no model; the continuation of the latest match of the sequence's last n tokens."""
