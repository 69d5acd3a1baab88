"""The burst node's side of the join (``kubeon-gpu node join``): its keys, the ticket redemption, the tunnel, the
kubelet's credentials, and the Node registration a kubelet does with them."""
