"""P's wing: leases on blocks held for D, the side-channel answers that admit D's requests, and push writes."""
