"""The burst tunnel's moving parts, shared by the gateway and the burst node: WireGuard keys, the userspace API
(UAPI) of ``wireguard-go``, interface/route/nftables set-up with iproute2 and nft, and a TCP proxy."""
