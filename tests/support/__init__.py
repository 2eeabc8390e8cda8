"""Test support only: helpers that let the tests run on this machine. Never imported by plugins/."""
