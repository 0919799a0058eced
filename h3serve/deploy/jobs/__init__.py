"""Video jobs, run in the ingress replica that accepted them: the record and its store (leases, cancel,
tombstones), the runner that drives a job on an H3 replica, the event log its readers follow."""
