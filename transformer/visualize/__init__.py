"""Looking inside: attention weights and figures."""
