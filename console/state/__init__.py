"""The console's one picture of the cluster: plain Python, no Textual, unit-tested on its own."""
