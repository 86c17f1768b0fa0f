"""The two roles a layout is told (``layouts``' call order): rank 0 coordinates, the rest follow."""

COORDINATOR = "coordinator"
FOLLOWER = "follower"
ROLES = (COORDINATOR, FOLLOWER)
