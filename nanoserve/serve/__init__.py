"""Lesson 08: serving. An async engine loop, an OpenAI-compatible HTTP server, and a serving benchmark."""
