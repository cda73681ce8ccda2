#!/usr/bin/env python3
"""Prints a TCP port P such that P and P + 1 are both free on this host.

torchrun's rendezvous store binds MASTER_PORT (P) and slime's bootstrap binds
MASTER_PORT + 1, so multi-process runs need the pair.
"""
import random
import socket
import sys


def free(port):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


for _ in range(500):
    p = random.randint(20000, 60000)
    if free(p) and free(p + 1):
        print(p)
        sys.exit(0)
sys.exit(1)
