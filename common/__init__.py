"""Plumbing the separate processes share (the worker, the burst gateway, the hub, the node agent), one job a module:
``kube`` builds the Kubernetes client, ``asgi`` limits request bodies, ``bearer`` is an HTTP client whose token
is a mounted file. Nothing here knows the product: it sits at the bottom of the import layers, beside ``models``."""
