"""The burst gateway (``kubeon-gpu gateway``): its own process, ServiceAccount and ticket key. It issues join
tickets (``tickets``), admits the node that redeems one (``admission``: the CSR check and signing), holds its
address slot (``slots``), ends its WireGuard tunnel (``tunnel_end``), applies the ticket to the Node that
registered and releases what is gone (``reconciler``), and removes burst Nodes; ``service`` composes these,
``app`` serves them over HTTPS to the optimizer (authenticated by TokenReview) and to booting nodes, ``main``
runs the process. The optimizer reaches it only through ``activities.clients.gateway``."""
