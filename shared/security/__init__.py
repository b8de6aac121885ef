"""Transport security shared by the services.

  grpc_tls        GrpcTlsConfig: TLS / mTLS for gRPC (server and channel credentials, one place)
  secret_files    reading secrets mounted as files (Kubernetes Secrets), redacting URLs for logs
"""
