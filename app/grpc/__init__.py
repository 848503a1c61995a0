"""The Open Inference Protocol over gRPC: the edge (`server`) and its generated protobuf code (`proto`)."""
