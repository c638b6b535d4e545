"""The parameter server: its optimizer loop, the workers' RPC, its training run and its watch."""
