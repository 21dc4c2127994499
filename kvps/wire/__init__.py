"""How nodes talk: protocol (messages and their schemas), transport (the Van: one I/O thread owns
every socket), requests (handles with deadlines) and membership (a node's life in the job)."""
