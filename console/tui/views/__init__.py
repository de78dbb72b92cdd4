"""One widget per view (topology, workers, models, events, router); each only renders ClusterState."""
