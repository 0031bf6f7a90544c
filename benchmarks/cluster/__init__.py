"""An emulated GPU cluster on one machine: network-namespace hosts whose links are shaped so that this
machine's compute : link bandwidth is a real cluster's (docs/multinode.md, "An emulated cluster")."""
