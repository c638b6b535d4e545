"""The models the lab builds on the ranks: the GPT of the notebooks and a Llama for dry runs at real sizes."""
