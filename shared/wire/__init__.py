"""The one place engine types and the gRPC contract's messages (protos/duet.proto) are
converted, both ways; the gateway and the workers call it, protos/ holds the contract only.

  sampling.py          SamplingParams (grammar included) <-> duet_pb2.SamplingParams
  outputs.py           StepOutput (tokens, logprobs, finish reasons, prompt logprobs, usage)
                       <-> Token, TokenChunk, PrefillReply
  reservation.py       KvReservation (the destination pages per rank, the write capability)
                       <-> duet_pb2.Reservation
  lease.py             the reservations a holder renews on a decode worker, and those it lost
                       <-> RenewLeaseRequest, RenewLeaseReply
  cache_scope.py       CacheScope (prefix-cache namespace, tenant) <-> the cache_namespace and
                       tenant fields of Reserve, Prefill and Generate requests
  resume.py            ResumedPrompt (a migrated stream's prompt and the completion tokens
                       already streamed) <-> prompt_token_ids + resumed_output_tokens
  fault.py             which worker a failed RPC blames (trailing metadata `duet-fault`)
  contract_overflow.py ContractOverflow: a value the contract cannot carry, refused by name

Scalars that travel as they are (request ids, prompt token ids, counts the RPCs ask for) are
read and written where they are used."""
