"""The agent-turns experiment: conversations that resend a long prefix, and its modes."""
